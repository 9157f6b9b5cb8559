"""A tracker's writer process (`rayhpc.tracking.runs.Tracker(process=True)`): reads the backends' makers, then
batches of run events, pickled on stdin by the job that started it, and writes them; answers each flush on
stdout. It ends when its stdin does (the job ended, or was killed: what it had queued is still written)."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading

from rayhpc.tracking.runs import Writer


def _read(source, items: queue.SimpleQueue) -> None:
    while True:
        try:
            batch = pickle.load(source)
        except (EOFError, OSError, pickle.UnpicklingError):
            items.put(None)
            return
        for item in batch:
            items.put(item)
            if item is None:
                return


def main() -> None:
    # Ctrl-C reaches the whole process group: the job stops itself and then ends this writer's input, so the
    # runs' last writes (interrupted, with their steps) are not lost with it
    for sig in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # stdout carries the answers alone: whatever a backend prints goes to stderr
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    source = sys.stdin.buffer
    makers = pickle.load(source)
    items: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(source, items), daemon=True).start()

    def ack(token) -> None:
        pickle.dump(token, answers)
        answers.flush()

    Writer(makers, items, ack).run()


if __name__ == "__main__":
    main()
