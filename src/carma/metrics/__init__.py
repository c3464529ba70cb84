"""Run metrics as CARMA defines them, timelines, tables and plots."""
