"""Adapters turn a ShardingIntent into what one engine consumes: a fully_shard plan, or a DeepSpeed config."""
