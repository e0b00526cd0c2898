"""The live processes a test marked with ``SHARDLAB_TEST_MARKER`` in their environment (zombies are gone already)."""

import psutil


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SHARDLAB_TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found
