"""Topology-aware expert swap (HierMoE Section IV): the swapper (``swapper``), which swap to
make (``policy``), the rows it moves between ranks (``transfer``) and its settings (``options``).
``moe_compile.expert_swapper`` is the public entry."""
