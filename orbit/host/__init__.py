"""This machine and this process: ports (net.py), directories written whole (files.py), a scratch
directory per process (scratch.py), Ctrl-C (interrupts.py), secrets kept out of logs
(secret.py) and torch's CPU threads per thread (threads.py)."""
