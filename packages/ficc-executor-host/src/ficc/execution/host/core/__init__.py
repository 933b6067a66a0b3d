"""The pure core: refusals and codes, leases, the attempt state machine, admission,
authority, request budgets, records, usage, metrics text and reply encoding.

Nothing here touches the kernel, a socket, SQLite or the event loop (a test holds it).

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
