"""The workload catalog (CARMA's training tasks) and trace loaders."""
