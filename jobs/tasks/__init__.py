"""Example tasks: `--task jobs/tasks/digits.py:DigitsCNN` in a checkout, or, once installed,
`--task rayhpc.examples.digits:DigitsCNN` (this folder installs as `rayhpc.examples`)."""
