"""Load a provider only after its installed files match the administrator's pin.

Order matters and is the point of this module: verify (digest.py, no import), compare
with the pinned `package_digest`, and only then import. The import itself is pinned
too: a meta-path finder owns the provider's top-level package names for the life of
the process and resolves them only to files the digest verified, so a second copy
earlier on sys.path, an unlisted module added later, or a namespace portion elsewhere
can never be imported under the provider's name. Sources are compiled from the
verified `.py` files; bytecode caches (`__pycache__`) are neither read nor written.

Residual risk (time of check to time of use): between hashing and import, and for
modules the provider imports lazily later, the files could change. Every file and
directory checked is owned by root and not writable by group or others, so only root
can change them in that window, and root can already change the daemon itself. The
provider's own dependencies (the standard library, ficc-protocol, ...) are not
covered by its pin; they are part of the host installation.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import CodeType, ModuleType
from typing import Any

import msgspec

from ficc.execution import provider as sdk
from ficc.execution.host.core.codes import HostCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.host.providers.digest import DistributionDigest, compute_digest
from ficc.execution.host.providers.driver import METHODS, bounded

API_VERSION = 1


@dataclass(frozen=True)
class LoadedProvider:
    """A configured provider: the verified distribution and the driver it returned."""

    id: str
    verified: DistributionDigest
    module: ModuleType
    driver: Any  # has the seven batch methods (checked at load)
    minimums: sdk.MinimumLimits | None = None
    """What the driver's `minimum_limits()` stated when it was configured (None: it
    has no such method): admission refuses a plan below it."""


def load_provider(
    name: str,
    pinned_digest: str,
    configuration: Mapping[str, Any],
    path: Sequence[str] | None = None,
) -> LoadedProvider:
    """Verify, compare with the pin, import, check the API, configure, check the driver,
    read its minimum limits."""
    verified = compute_digest(name, path)
    if verified.digest != pinned_digest:
        raise HostError(
            HostCode.PROVIDER_DIGEST_MISMATCH,
            f"provider {name!r} ({verified.name} {verified.version}) is installed with "
            f"digest {verified.digest} but the configuration pins {pinned_digest}; review "
            f"the installed provider, then run `python -m ficc.execution provider-digest "
            f"{name}` and pin the digest it prints",
        )
    module_name, _, attribute = verified.distribution.entry_point.partition(":")
    module = _import_pinned(verified, module_name.strip())
    target = _resolve(module, attribute.strip(), name)
    api_version = getattr(target, "API_VERSION", None)
    if type(api_version) is not int or api_version != API_VERSION:
        raise HostError(
            HostCode.PROVIDER_API_VERSION,
            f"provider {name!r} declares API_VERSION {api_version!r}; this host speaks "
            f"{API_VERSION}: install a provider release built for API version {API_VERSION}",
        )
    configure = getattr(target, "configure", None)
    if not callable(configure):
        raise HostError(HostCode.PROVIDER_INVALID, f"provider {name!r} has no callable configure()")
    try:
        driver = configure(dict(configuration))
    except (Exception, SystemExit) as error:  # a provider's sys.exit() must not stop the host
        raise HostError(
            HostCode.PROVIDER_CONFIGURE_FAILED,
            f"provider {name!r} refused its configuration: {bounded(error)}; "
            "fix the provider's configuration object",
        ) from error
    missing = [method for method in METHODS if not callable(getattr(driver, method, None))]
    if missing:
        raise HostError(
            HostCode.PROVIDER_INVALID,
            f"provider {name!r} returned a driver without {', '.join(missing)}; "
            "it does not implement the provider interface",
        )
    return LoadedProvider(name, verified, module, driver, _minimum_limits(name, driver))


def _minimum_limits(name: str, driver: Any) -> sdk.MinimumLimits | None:
    """The smallest limits the driver states its runtime needs, read once here so that
    admission can refuse a plan below them without calling the provider (a provider
    call comes only after an admission is committed). Optional: a driver without
    `minimum_limits` states none. A statement the SDK would not build, or a method that
    raises, makes the provider unavailable, as a failed `configure()` does."""
    state = getattr(driver, "minimum_limits", None)
    if state is None:
        return None
    try:
        return sdk.decode_minimum_limits(state() if callable(state) else state)
    except msgspec.ValidationError as error:
        raise HostError(
            HostCode.PROVIDER_INVALID,
            f"provider {name!r} states minimum limits the provider SDK would not build"
            f" ({error}); install a provider release that builds them with"
            " sdk.MinimumLimits",
        ) from error
    except (Exception, SystemExit) as error:  # a provider's sys.exit() must not stop the host
        raise HostError(
            HostCode.PROVIDER_CONFIGURE_FAILED,
            f"provider {name!r} could not state its minimum limits: {bounded(error)}; fix"
            " the provider's configuration object",
        ) from error


def _import_pinned(verified: DistributionDigest, module_name: str) -> ModuleType:
    top = module_name.split(".", maxsplit=1)[0]
    if top not in verified.import_roots:
        raise HostError(
            HostCode.PROVIDER_UNSUPPORTED,
            f"entry point module {module_name!r} is not a regular package or module "
            f"installed by {verified.name}; the provider cannot be pinned",
        )
    already = sorted(m for m in sys.modules if m == top or m.startswith(top + "."))
    if already:
        raise HostError(
            HostCode.PROVIDER_ALREADY_IMPORTED,
            f"{already[0]!r} was imported before its digest was checked; "
            "restart the daemon so the provider is loaded only through the pin",
        )
    finder = _PinnedFinder(verified)
    sys.meta_path[:] = [f for f in sys.meta_path if not _owns_any(f, finder.roots)]
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()  # directory listings may predate the files we verified
    try:
        return importlib.import_module(module_name)
    except HostError:
        raise
    except (Exception, SystemExit) as error:  # a provider's sys.exit() must not stop the host
        raise HostError(
            HostCode.PROVIDER_IMPORT_FAILED,
            f"importing provider module {module_name!r} failed: {bounded(error)}; install "
            "what it needs into the daemon's environment or reinstall the provider, then pin "
            "the digest `ficc-executor provider-digest` prints",
        ) from error


def _resolve(module: ModuleType, attribute: str, name: str) -> Any:
    target: Any = module
    for part in attribute.split(".") if attribute else []:
        try:
            target = getattr(target, part)
        except AttributeError:
            raise HostError(
                HostCode.PROVIDER_INVALID,
                f"provider {name!r} entry point names missing {attribute!r}",
            ) from None
    return target


def _owns_any(finder: object, roots: frozenset[str]) -> bool:
    return isinstance(finder, _PinnedFinder) and bool(finder.roots & roots)


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compile from the verified source; never read or write a bytecode cache."""

    def get_code(self, fullname: str) -> CodeType:
        return self.source_to_code(self.get_data(self.path), self.path)


class _PinnedFinder(importlib.abc.MetaPathFinder):
    """Resolves the provider's package names to verified files only, or refuses."""

    def __init__(self, verified: DistributionDigest) -> None:
        self.roots = verified.import_roots
        self.site_dir = str(verified.distribution.site_dir)
        self.allowed = verified.verified_paths()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", maxsplit=1)[0] not in self.roots:
            return None
        search = [self.site_dir] if path is None else list(path)
        spec = importlib.machinery.PathFinder.find_spec(fullname, search)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        if spec.origin is None or os.path.normpath(spec.origin) not in self.allowed:
            raise HostError(
                HostCode.PROVIDER_TAMPERED,
                f"module {fullname!r} resolves to {spec.origin!r}, which is not a verified "
                "file of the pinned provider",
            )
        if isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return importlib.util.spec_from_file_location(
                fullname,
                spec.origin,
                loader=_SourceOnlyLoader(fullname, spec.origin),
                submodule_search_locations=spec.submodule_search_locations,
            )
        return spec
