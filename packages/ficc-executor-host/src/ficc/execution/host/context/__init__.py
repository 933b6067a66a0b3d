"""The daemon's shared parts: the context the layers above share, the worker
threads' queue, group commits of renewals and the reused buffers.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
