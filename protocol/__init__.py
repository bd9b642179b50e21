"""dpool.protocol"""
