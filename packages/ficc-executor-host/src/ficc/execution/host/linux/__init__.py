"""Kernel adapters that know nothing of attempts: confined file helpers, filesystem
types, seccomp filters, the boot-time clock, sd_notify, /proc reads and the host-wide
task scan.

Modules are imported by their own path; this package re-exports nothing, so a test
that patches a module patches the code that runs.
"""
