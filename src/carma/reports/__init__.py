"""What people read of runs, from the twin or a daemon: run records, result tables, PNG charts, HTML reports."""
