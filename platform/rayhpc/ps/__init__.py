"""Parameter-server training on Ray actors: synchronous (equal to DDP) and asynchronous (Downpour SGD
with bounded staleness), for any task; `rayhpc.ps.driver.run_ps` is the job."""
