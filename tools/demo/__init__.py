"""The demo: one real job through the executor host daemon and the Podman provider.

`python tools/demo.py` (normally `tools/dev demo`, which runs `nox -s demo`) sets up a
complete host in a private directory under /run/ficc-demo and runs one job through the
protocol client, printing every step. The modules, in the order the demo uses them:

    layout      where everything of one run lives (pure)
    config      the administrator's configuration document (pure)
    job         the job: its input text, payload script and plan (pure)
    host        the machine side: accounts, wheels, the pinned provider, the test image
    daemon      the daemon as a child process: READY=1, log, stop
    controller  the controller side: every protocol step, run as the transport account
    report      step lines and the summary table (pure)
    main        the whole run, in order
"""
