"""The async router: API, forwarding, metrics and the command line."""
