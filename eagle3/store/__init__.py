"""The data the trainer reads: what it asks of any store (``feed``), the harvest store (``shards``),
plans without states (``planned``), the online spool (``spool``), co-located capture (``colocated``,
``capture``), the trainer's data settings (``spec``) and the batches of an epoch (``batches``)."""
