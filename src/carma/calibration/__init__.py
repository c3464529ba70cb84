"""Calibrating the digital twin on measurements: fits, profiles, and the fidelity report.

Needs the optional extra `carma-gpu[calibrate]` (SciPy) and the public datasets (Lucid, GPUMemNet, CARMA's
workload table); the fitted parameters and profiles it writes ship with carma, so simulating needs
neither.
"""
