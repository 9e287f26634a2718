r"""The schedule: which collectives run, in what order, on futures, and nothing of DDP,
Horovod or FSDP.

Every exchange takes a :class:`~hhook.schedule.context.CallContext` of plain data (the
group, rank and world, the counters, the scale policy, the options hash, the handshake's
fields, the node layout), made once per group and configuration by its caller, and the
:class:`~hhook.schedule.context.GroupRuntime` behind it (second communicators, launch
order, device flags). :func:`~hhook.schedule.allreduce.reduce_async` is the entry: the
flat schedule (:mod:`~hhook.schedule.flat`: one SUM, or a MAX then a SUM on a second
communicator in hook order) or, where the node layout (:mod:`~hhook.schedule.topology`)
found several nodes, the two-level one (:mod:`~hhook.schedule.two_level`: dense inside a
node, flat between nodes); :mod:`~hhook.schedule.reduce_scatter` is FSDP2's gradient
reduce-scatter with the same stages. Before a state's first exchange on a group, the one
options handshake (:mod:`~hhook.schedule.handshake`); for what THC does not compress, the
one dense fallback (:mod:`~hhook.schedule.dense`). Below them: futures and continuations
that never wait and the order they launch collectives in (:mod:`~hhook.schedule.futures`),
the second communicator and explained failures (:mod:`~hhook.schedule.groups`),
node shared memory (:mod:`~hhook.schedule.node_memory`), the end of a job
(:mod:`~hhook.schedule.teardown`) and who stalled (:mod:`~hhook.schedule.blame`).
"""

from . import teardown  # noqa: F401 - ends hhook's continuations before destroy_process_group and at exit
