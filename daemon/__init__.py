"""dpool.daemon"""
