"""The durable ledger: the SQLite store and its transactions, the schema and row
mapping, the size and free-space bounds, and the records kept in memory.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
