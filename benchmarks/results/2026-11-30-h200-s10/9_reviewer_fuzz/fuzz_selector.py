import torch,random,sys;sys.path.insert(0,'.')
import os
if d0:=os.environ.get('TRITON_INTERPRET'):
 from sp_kpool.testing.triton_interp import interpreted_module as im;ta=im('sp_kpool.kernels.triton_select').topk_ascending
else:from sp_kpool.kernels.triton_select import topk_ascending as ta
from sp_kpool.selection import topk_pools,_ascending
r=random.Random(0);d=sys.argv[2];M=3.4028234663852886e38;I=float('inf')
sp=[0.,-0.,1e-45,-1e-45,1e-40,-1e-40,M,-M,I,-I,float('nan'),1.,-1.,3e38,-3e38]
def row(W):
 t=r.randrange(6)
 if t==0:return torch.tensor([r.choice(sp) for _ in range(W)])
 if t==1:
  x=torch.randn(W)*10**r.uniform(-40,38);m=torch.rand(W)<r.random()*.3
  x[m]=torch.tensor([r.choice(sp) for _ in range(int(m.sum()))]);return x
 if t==2:
  v=[r.choice(sp+[r.uniform(-5,5)]) for _ in range(r.randint(1,4))];return torch.tensor([r.choice(v) for _ in range(W)])
 if t==3:
  b=torch.tensor([r.choice([1.,-1.,0.,3e38,-3e38,1e-44])]);return (b.view(torch.int32)+torch.randint(-6,7,(W,),dtype=torch.int32)).view(torch.float32)
 if t==4:return torch.exp(torch.randn(W)*r.uniform(1,30))*r.choice([1,-1])
 x=torch.randn(W);x[:r.randrange(W)]=r.choice([M,I,-M,1e-40]);return x
bad=0;n=0
for it in range(int(sys.argv[1])):
 R=r.randint(1,64);W=r.choice([40,257,1500,8192,20000]);k=r.choice([1,2,3,8,17,64,100,512,2048])
 s=torch.stack([row(W) for _ in range(R)]).float()
 st=torch.randint(0,W,(R,));en=torch.maximum(st,torch.randint(0,W+1,(R,)))
 cols=torch.arange(W);vis=(cols>=st[:,None])&(cols<en[:,None])&(s!=-I)
 p,ok=topk_pools(s,vis,k,0);p=_ascending(torch.where(ok,p,-1))
 ref=torch.full((R,k),-1,dtype=torch.int64);ref[:,:p.shape[1]]=p
 kw=dict(ways=r.choice([2,3]),vsteps=r.choice([None,1,3,64]))
 if r.random()<.3:kw['min_group']=4
 try:
  g=ta(s.to(d),st.to(d),en.to(d),torch.zeros(R,dtype=torch.int64,device=d),k,**kw).cpu()
 except ValueError as e:continue
 n+=1
 if not torch.equal(g.long(),ref):
  bad+=1;print('FAIL',it,R,W,k,kw,flush=True);torch.save(dict(s=s,st=st,en=en,k=k,kw=kw),f'/tmp/out_{it}.pt')
print('selector fuzz ran',n,'bad',bad)
