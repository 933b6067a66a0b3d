"""ficc-executor-host: the root daemon that runs other people's jobs on this host.

The folder layout is the architecture: one folder per layer (`core`, `linux`, `storage`,
`ledger`, `config`, `service`, `gate`, `providers`, `context`, `runner`, `api`, `daemon`,
`cli`), each importing only from the layers before it (the README's table, held by
`tests/test_layers.py`). Logic is sans-I/O wherever it can be; the asyncio server is a
thin shell around it. The top-level modules are the stable public paths: `commands`
(the command's entry point), `conformance` (the provider conformance kit) and `sdk`
(the provider contract's old path, deprecated).
"""
