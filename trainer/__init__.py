"""dpool.trainer"""
