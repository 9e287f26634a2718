r"""The schedule: which collectives run, in what order, on futures, and nothing of DDP,
Horovod or FSDP.

:func:`~hhook.schedule.allreduce.thc_allreduce_async` is the entry every integration
calls, with a narrow :class:`~hhook.schedule.context.CallContext` of its caller (the
schedule owns the :class:`~hhook.schedule.context.GroupRuntime` behind it: node layout,
second communicators, launch order, handshakes): the flat schedule
(:mod:`~hhook.schedule.flat`: one SUM, or a MAX then a SUM on a second communicator in
hook order) or, where the node layout
(:mod:`~hhook.schedule.topology`) found several nodes, the two-level one
(:mod:`~hhook.schedule.two_level`: dense inside a node, flat between nodes). FSDP2's
gradient reduce-scatter runs :mod:`~hhook.schedule.reduce_scatter` with the same stages. Below them:
futures and continuations that never wait (:mod:`~hhook.schedule.futures`), the second
communicator and explained failures (:mod:`~hhook.schedule.groups`), launch order
(:mod:`~hhook.schedule.sequencer`), node shared memory (:mod:`~hhook.schedule.node_memory`),
the end of a job (:mod:`~hhook.schedule.teardown`) and who stalled
(:mod:`~hhook.schedule.blame`).
"""
