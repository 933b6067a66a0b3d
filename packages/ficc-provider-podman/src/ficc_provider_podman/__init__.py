"""ficc-provider-podman: the reference ficc executor provider.

Registered as entry point `podman` in group `ficc.executor`; the host loads
`ficc_provider_podman.driver` (API_VERSION, configure) after verifying the installed
distribution against the administrator's pinned digest. Each job runs in a rootless
Podman container as the slot account, inside the host-created service, behind the
trusted static barrier (`ficc_provider_podman.barrier`). See docs/providers.md.
"""
