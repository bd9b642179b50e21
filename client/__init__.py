"""dpool.client"""
