/* Standalone timing of pa_decode (not a test; run by hand), caches of L layers cycled as in a model step.
 *   gcc -O3 -std=c11 -fopenmp -mavx2 -mfma -mavx512f -mavx512bw -mavx512bf16 \
 *       -DKSRC="\"../../kernels/csrc/paged_attn.c\"" paged_attn_harness.c -o /tmp/h -lm
 *   /tmp/h N threads [part_tokens [dtype 1=bf16 0=fp32 [layers [rounds<=64]]]]   (CTX=320 sets the length for N=1)
 * N=1: one request of CTX tokens; N>1: lengths 256..384. Prints median wall and CPU us per layer. */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include KSRC
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double cpu(void){struct timespec t;clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  int N=atoi(argv[1]), threads=atoi(argv[2]); int part=argc>3?atoi(argv[3]):0; int dtype=argc>4?atoi(argv[4]):1;
  int L=argc>5?atoi(argv[5]):30,H=9,Hkv=3,D=64,BS=16; int lo=256,hi=384; if(N==1){lo=hi=getenv("CTX")?atoi(getenv("CTX")):320;}
  srand(1); int32_t lens[64]; int maxb=0,totb=0;
  for(int n=0;n<N;n++){lens[n]=lo+rand()%(hi-lo+1); int b=(lens[n]+BS-1)/BS; totb+=b; if(b>maxb)maxb=b;}
  int nb=totb+1; size_t esz=dtype?2:4; size_t per=(size_t)nb*BS*Hkv*D;
  char*K=malloc(per*esz*L),*V=malloc(per*esz*L);
  for(size_t i=0;i<per*L;i++){float f=(rand()/(float)RAND_MAX-0.5f)*2; if(dtype){uint16_t h=f32_to_bf16(f);((uint16_t*)K)[i]=h;((uint16_t*)V)[i]=f32_to_bf16(-f*0.7f);}else{((float*)K)[i]=f;((float*)V)[i]=-f*.7f;}}
  int32_t*bt=calloc(N*(maxb+1),4); int*ids=malloc(nb*4); for(int i=0;i<nb-1;i++)ids[i]=i+1;
  for(int i=nb-2;i>0;i--){int j=rand()%(i+1);int t=ids[i];ids[i]=ids[j];ids[j]=t;}
  int k=0; for(int n=0;n<N;n++){int b=(lens[n]+BS-1)/BS; for(int j=0;j<b;j++)bt[n*(maxb+1)+j]=ids[k++];}
  char*q=malloc(N*H*D*esz),*out=malloc(N*H*D*esz);
  for(int i=0;i<N*H*D;i++){float f=(rand()/(float)RAND_MAX-0.5f)*4; if(dtype)((uint16_t*)q)[i]=f32_to_bf16(f); else ((float*)q)[i]=f;}
  omp_set_dynamic(0);
  int R=argc>6?atoi(argv[6]):15; if(R>64)R=64; if(R<1)R=1; double t[64], tc[64];
  for(int r=0;r<R+2;r++){double t0=now(), c0=cpu();
    for(int l=0;l<L;l++){ if(pa_decode(q,H*D,K+l*per*esz,V+l*per*esz,bt,maxb+1,lens,N,H,Hkv,D,BS,0.125f,out,H*D,dtype,part,threads)) {printf("fail\n");return 1;} }
    if(r>=2){t[r-2]=(now()-t0)/L*1e6; tc[r-2]=(cpu()-c0)/L*1e6;}}
  qsort(t,R,sizeof(double),cmpd); qsort(tc,R,sizeof(double),cmpd);
  double bytes=0; for(int n=0;n<N;n++)bytes+=2.0*lens[n]*Hkv*D*esz;
  float cs=0; for(int i=0;i<N*H*D;i++) cs+= dtype? bf16_to_f32(((uint16_t*)out)[i]) : ((float*)out)[i];
  printf("N=%d thr=%d part=%d: wall median %.1f us/layer (min %.1f) cpu %.1f  %.2f GB/s  chk %.4f\n",N,threads,part,t[R/2],t[0],tc[R/2],bytes/t[R/2]/1e3,cs);
  return 0;}
