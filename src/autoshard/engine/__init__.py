"""What both front ends run, the Trainer's (``autoshard.lightning``) and Fabric's (``autoshard.fabric``): the checks
when the Trainer or Fabric is built (``base``, ``launch``, ``fsdp2``), the auto-shard choice (``auto_shard``), the FSDP2
setup sequence and its guarantees (``sharding``, ``guarantees``, ``meta_init``), the run decided at setup (``run``),
DeepSpeed's run-time needs (``deepspeed``), the collectives every rank runs alike (``ranks``), and which front end a
message speaks to (``front_end``). Nothing here imports either front end.
"""
