"""The read-only web dashboard of a pool: pages, live updates and Prometheus metrics (README: "Seeing the pool")."""
