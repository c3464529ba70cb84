"""The digital twin: an event-driven simulation of a GPU server that drives the decision core."""
