"""What producers import: sync/async clients, the bulk batch runner and the CLI. Never imports torch."""
