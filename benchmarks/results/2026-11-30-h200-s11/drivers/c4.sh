set -u
source gpu11/setup.sh
mkdir -p $OUT/fr $OUT/sel
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/fr timeout 300 python3 gpu11/fr.py 32,64 > $OUT/fr/fr.log 2>&1; echo "fr rc=$?"; cat $OUT/fr/fr.log | cut -c1-400
OUT=$OUT/sel timeout 200 python3 gpu11/fr_rand.py > $OUT/sel/sel.log 2>&1; echo "fr_rand rc=$?"
cat $OUT/sel/sel.log
