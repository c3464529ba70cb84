"""Dynamic MIG partitioning (issue 47): the geometry of MIG GPUs as data, and a pure partition manager
that plans which idle instances to destroy and which to create so a task gets the tightest instance."""
