"""The attempt runner: the prepare and start pipelines, the work after a reply, the
lease deadlines and the periodic monitor.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
