"""One module per `vitlab` sub-command; each defines `register(subparsers)`."""
