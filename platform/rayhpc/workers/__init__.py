"""A group of Ray actors that form one `torch.distributed` world: the platform's own worker group,
shared by the model-parallel job (`rayhpc.parallel`) and the collectives benchmark."""

from rayhpc.workers.group import WorkerContext, WorkerGroup, WorkerGroupError

__all__ = ["WorkerContext", "WorkerGroup", "WorkerGroupError"]
