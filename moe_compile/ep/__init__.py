"""The expert-parallel runtime: the table of compiled layers (``runtime``: placement, current
plan, statistics, traffic counters), mesh communicators (``comm``) and process groups with the
user's timeout (``groups``), expert shards (``shard``), layer setup (``setup``) and the ranks'
agreement on what is rewritten (``agreement``). It imports ``cost`` only, never the passes."""
