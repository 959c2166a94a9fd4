"""Plans, the sharding layouts they imply, and re-layout manifests."""
