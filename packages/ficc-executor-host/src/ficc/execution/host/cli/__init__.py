"""The `ficc-executor` commands, the smoke test, slot provisioning and the provider
conformance kit. The stable entry points are the top-level `commands` and
`conformance` modules.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
