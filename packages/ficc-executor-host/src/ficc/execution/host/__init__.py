"""ficc-executor-host: the root daemon that runs other people's jobs on this host.

The folder layout is the architecture: one module per concept (`config`, `leases`,
`ledger`, `staging`, `gate`, ...), subpackages where a concept has backends
(`service/`) or several parts (`providers/`). Logic is sans-I/O wherever it can be;
the asyncio server is a thin shell around it.
"""
