"""gunicorn settings for prometheus_client's multiprocess mode, as docs/metrics.md shows.

Each worker writes its samples to files in PROMETHEUS_MULTIPROC_DIR (set in the environment
before gunicorn starts); ``MultiProcessCollector`` adds them up when scraped.
"""

from prometheus_client import multiprocess


def child_exit(server, worker):
    multiprocess.mark_process_dead(worker.pid)
