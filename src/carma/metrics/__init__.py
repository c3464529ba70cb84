"""Run metrics as CARMA defines them and the per-GPU timelines they integrate: what the twin needs, no more."""
