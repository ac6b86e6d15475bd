"""``kvroute drill``: drive load through a router, inject a fault into one replica, report what
clients lost (nothing) and how fast the router noticed.
"""
