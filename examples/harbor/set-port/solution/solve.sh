#!/bin/bash
set -e
sed -i 's/^port = 8080$/port = 8443/' /app/service.ini
echo "Changed the port in /app/service.ini from 8080 to 8443."
