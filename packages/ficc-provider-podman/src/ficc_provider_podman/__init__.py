"""ficc-provider-podman: the reference ficc executor provider.

So far this distribution ships the trusted barrier (`ficc_provider_podman.barrier`).
The `podman` entry point in group `ficc.executor` and its driver arrive with the
first real job; until then nothing registers, so no host can select it.
"""
