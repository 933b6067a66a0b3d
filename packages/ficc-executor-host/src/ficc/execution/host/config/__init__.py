"""The administrator's configuration: the model, its rules, the trusted file reads,
the checks of the host it describes, and the ceiling and initial offer it sets.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
