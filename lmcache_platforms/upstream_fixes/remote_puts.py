"""A fix for LMCache 0.5.6's remote backend, which forgets the writes it sends as one batch.

``RemoteBackend`` keeps the keys it is writing in ``put_tasks``: its own duplicate check reads them, and so
does our wait for writes in flight before an engine closes (``integration.vllm.pending_writes``). One key at
a time (``submit_put_task``) it adds each key before the write and removes it when the write is done; as one
batch (``batched_submit_put_task``, taken whenever the connector announces ``batched_put``, as both Redis
connectors do) it only removes them. So with Redis nothing looked in flight: a server stopped right after a
store closed without waiting and lost those chunks, and a load planted right after a store missed them.
The wrapper adds the batch's keys before upstream sends it; upstream's completion callback removes them.
"""

from __future__ import annotations

from typing import Any


def wrap_batched_submit_put_task(upstream: Any) -> Any:
    """Patch-catalog wrapper of ``RemoteBackend.batched_submit_put_task``."""

    def batched_submit_put_task(self: Any, keys: Any, memory_objs: Any, *args: Any, **kwargs: Any) -> Any:
        sent_as_batch = (self.connection is not None and self.connection.support_batched_put()
                         and not getattr(self, "_mla_worker_id_as0_mode", False))
        if sent_as_batch:
            with self.lock:
                self.put_tasks.update(keys)
        try:
            return upstream(self, keys, memory_objs, *args, **kwargs)
        except BaseException:
            if sent_as_batch:  # nothing was sent, so no completion will remove them
                with self.lock:
                    self.put_tasks.difference_update(keys)
            raise

    return batched_submit_put_task
