"""`diloco`'s exit when a learner left a thread behind at its deadline (an upload still encoding): the
process exits at once with the command's own code and says which thread it did not wait for, instead
of tearing the interpreter down under a thread inside a torch op (SIGABRT)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import threading, torch
import diloco.infra.cli as cli
from diloco.workers.threads import abandon

def busy():
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)

def main():
    thread = threading.Thread(target=busy, name="uploader-x", daemon=True)
    thread.start()
    abandon(thread)
    return 3

cli.main = main
cli.run()
"""


def test_a_command_that_left_a_busy_thread_behind_exits_with_its_own_code_at_once():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "leaving without waiting for thread(s) uploader-x" in done.stderr
