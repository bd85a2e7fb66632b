"""The admin API and live web console (`conductor admin`): read the cluster, steer it through the control topic."""
