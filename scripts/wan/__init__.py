"""The WAN lab: network namespaces joined through a bridge, with each link shaped to a profile (rate by tbf,
delay, jitter and loss by a user-space forwarder). See lab.py and the README's "WAN lab"."""
