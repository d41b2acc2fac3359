"""``fmha report``: the engineering ladder and the peers, written as markdown and PNG plots."""
