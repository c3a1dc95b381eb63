"""SLIs, error budgets and multiwindow burn rates, from the agents' metric rollups."""
