"""The Python client: ``Client`` (async), ``SyncClient`` (blocking) and ``DistributedLearner``.

``SyncClient`` is a blocking wrapper for scripts; ``DistributedLearner`` drives one paced train
job an epoch at a time (``run_epoch``, ``shared.client.learner``).

```python
async with Client("localhost:50051") as c:
    job = await c.submit({"kind": "train", "workers": 3})
    async for job, progress in c.watch(job.job_id):
        print(job.state, progress.get("step"))
```
Errors surface as ``NeuroshardError`` with the gRPC status code and a one-line message.
Keyed memory operations go straight to the workers holding the ids' slots
(``shared.client.memory``); everything else goes to the coordinator.
"""

from shared.client.async_client import (
    DEFAULT_ADDRESS,
    Client,
    JobInfo,
    NeuroshardError,
    default_address,
)
from shared.client.learner import DistributedLearner
from shared.client.sampling import SampleBatch
from shared.client.sync_client import SyncClient

__all__ = [
    "DEFAULT_ADDRESS",
    "Client",
    "DistributedLearner",
    "JobInfo",
    "NeuroshardError",
    "SampleBatch",
    "SyncClient",
    "default_address",
]
