"""A discrete-event simulator of XpYd disaggregated serving with a shared KV store."""
