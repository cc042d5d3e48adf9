"""The cache-policy options every command line takes, by their argparse names (dests): derived from the methods'
declarations (`kvjax.policies.options`), each going to the methods that take it; a suite keyed by policy
descriptions leaves them out of its identity."""

from kvjax.policies.options import Live, all_options

POLICY_OPTIONS = Live(lambda: all_options().keys())
"""Every method option's dest, live: an option a method registered later declares is in it."""
