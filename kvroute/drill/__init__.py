"""``kvroute drill``: drive load through a router, inject a fault into one replica, report."""
